"""The `canopy` subcommands (demo, up/down/status, plan, sim, mine, proposal) and what only
they use (pictures, the report's figures, the demo's self-organisation phase)."""
