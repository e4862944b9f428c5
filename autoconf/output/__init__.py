"""What a person sees: rich tables (``tables``, ``plan_report``), pictures (``plots``) and
progress bars.
"""
