"""Launching a plan: the launch plan file (``plan``), shell quoting (``shell``), hosts, one
emitter per framework (``megatron``, ``torchtitan``, ``deepspeed``; ``gaps`` says what each cannot
express), the launch directory (``emit``) and PLAN.md.
"""
