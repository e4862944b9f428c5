"""The reference trainer (imports torch): a GPT built from a ``ModelSpec`` (``layers``, ``moe``,
``fp8``, ``ring_attention``, ``tensor_parallel``) and run under a configuration with PyTorch's own
distributed building blocks. Depends only on ``specs``, ``space`` and the launch plan file.
"""
