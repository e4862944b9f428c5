"""How a run is split: the configuration and its rules (``config``), rank order and placement
(``placement``), and the rules shared by the cost model and the trainer (``schedules``,
``compression``, ``allreduce``).
"""
