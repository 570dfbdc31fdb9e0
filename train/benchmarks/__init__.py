"""The benchmarks' library (the commands are train/bench.py and train/bench_data.py): the training step, the input
path, the peer trainer's step, torchao's fp8 linears."""
