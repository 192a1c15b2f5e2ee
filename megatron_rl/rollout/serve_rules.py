"""Which SGLang version's HTTP rules our ``serve`` imitates (torch-free: config loading and the
CLI parser read these)."""

NEW_RULES, OLD_RULES = "0.5.21", "0.5.20"
RULES = (NEW_RULES, OLD_RULES)  # SGLang >= 0.5.21 (weight-update sessions) | <= 0.5.20
