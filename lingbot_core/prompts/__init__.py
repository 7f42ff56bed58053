"""Prompts: the caption JSON and its checks, the text conditioning of the DiT, the rewriter, negative prompts.

Imports lingbot_core.net (the rewriter's chat client) and lingbot_core.files (files.named_files: how a text
file a stranger named is read).
"""
