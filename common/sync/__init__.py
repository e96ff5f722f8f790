"""The weight-sync contract: fingerprints, write recording, manifests, the seven checks, transports."""
