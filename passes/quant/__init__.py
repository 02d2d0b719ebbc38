"""Weight quantization: 4-bit blocks, their search, calibration and error feedback."""
