"""The global scheduler: site registry, capacity, outstanding work, routing, admin."""
