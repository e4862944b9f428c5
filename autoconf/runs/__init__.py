"""Running things for real: trials of a launch plan (``trial``), verification of a search's best
(``verify``), and the testbed of emulated nodes (``testbed``).
"""
