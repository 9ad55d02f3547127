"""megascope's fully parallel GPT trainer (DP with a sharded optimizer, TP, SP, PP)."""
