"""`portaserve bench throughput|latency|serve`: offline and online benchmarks."""
