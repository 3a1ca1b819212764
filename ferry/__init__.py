"""ferry: batching of concurrent calls (the integrator fills in the public names)."""
