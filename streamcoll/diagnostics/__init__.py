"""Diagnostics that observe the core (they attach through core.hooks, never imported by it):
the watchdog, flight dumps and their analysis, signals, /dev/shm cleanup."""
