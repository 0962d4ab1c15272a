"""Engines, measurement and model resolution. No terminal code lives here."""
