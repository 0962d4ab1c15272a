"""Serving: the load client for an OpenAI-compatible server (load) and the serving benchmark and
interference lab on this machine's engine."""
