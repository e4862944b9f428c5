"""What is trained on what: the model (``model``, ``hf``), the cluster (``cluster``,
``topology``, ``measured_graph``), the device catalog (``devices``), the training frameworks'
behaviour (``frameworks``), the profile format (``profile``), units and the schema machinery.
"""
