"""The model-parallel mode (encoder GPU + decoder GPU, pipelined): not built yet.

`qwen_edit.parallel.mode = "model_parallel"` is refused by the config check until it exists.
"""
