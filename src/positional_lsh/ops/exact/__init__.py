"""The exact ops and the dense oracles: exact and windowed ALiBi (``alibi_attention``), general decays
(``decay_attention``), and the float64 ``n x n`` references every test compares against (``reference``)."""
