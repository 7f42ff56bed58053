"""How the pack talks to servers: one HTTP transport with a total deadline, the user's server list, the chat client.

Imports nothing else of lingbot_core.
"""
