"""What the pack knows about the device it runs on, below the kernel: nothing here imports the kernel.

    detection      does this device need tiled attention (arch tables, a probe of torch's fused backends)
    profiles       per-device tuned tile profiles (attention_core.cli.tune writes them, the kernel's driver reads them)
    calibration    the measured-throughput file of attention_core.cli.calibrate (the estimate's input)
    jsonfile       JSON files on the user's disk as untrusted input (atomic writes, validated reads)
    machine_load   how busy other processes kept the CPUs while something was timed
    torch_version  the oldest torch the engine runs on, checked first when the package is imported
    torch_sdpa     torch's own SDPA (the builtin), whatever is patched: the yardstick of selfcheck, bench, calibrate
"""
