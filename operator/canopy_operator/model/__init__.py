"""The domain model, pure: the overlay spec and its validation (topology), plans and the
reconcile decision (planner), and TopologyProposals with their lifecycle decision (proposals).
No I/O: no asyncio, aiohttp, kopf or kubernetes (an import-linter contract)."""
