"""What the tests share that is not a test: tiny models and checkpoint layouts, engine
jobs in a child process, CPU kernel registration, the Triton kernel sweep and compile
checks, and the workloads (chat prompts, the soak workload, the server memory run).

Imported as `support.<module>` (pytest puts tests/ on sys.path); nothing outside
tests/ imports it.
"""
