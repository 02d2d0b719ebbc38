"""Checkpoints from the hub that arrive quantized (AWQ, GPTQ): their blocks read exactly."""
