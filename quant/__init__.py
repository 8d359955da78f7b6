"""The converter: calibration, RTN / AWQ / GPTQ quantization, writing ``.eif`` files."""
