"""The UCX transport of the weight plane (ucxx)."""
