"""`lockstep bench`: decode-step benchmark of the engine against its HBM floor and HF compiled.

    `options`   arguments checked before any GPU work (pure Python, CPU-testable).
    `modeldir`  fast random-weight model directories for `--preset` (drawn on the GPU).
    `floor`     measured read bandwidth and the bytes a decode step must read.
    `decode`    the engine's decode step, eager and graph replay, per rank (TP over NCCL).
    `hf`        HF transformers StaticCache + torch.compile(mode="reduce-overhead").
    `report`    stdout table, JSON and the PNG plot.
"""
