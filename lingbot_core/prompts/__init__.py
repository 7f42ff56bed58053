"""Prompts: the caption JSON and its checks, the text conditioning of the DiT, the rewriter, negative prompts.

Imports lingbot_core.net only (the rewriter's chat client).
"""
