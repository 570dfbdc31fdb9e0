"""Library code of the benchmarks (train/bench.py is the command): the peer trainer's step, torchao's fp8 linears."""
