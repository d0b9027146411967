"""The attention dispatch's backend names, without importing torch (the CLI's choices and `RunOptions` read them).

`kernels/attention.py` describes each backend and runs it.
"""

# torch SDPA implementations a caller may pin, by the name each face shows.
SDPA_BACKEND_NAMES = ("math", "flash", "efficient", "cudnn")
BACKENDS = ("auto", "sdpa", "fa3", "fa3-fp8", *SDPA_BACKEND_NAMES)
