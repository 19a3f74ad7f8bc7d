"""The task benchmark (`kl-adapters demo --task`, bench/task.py): does the exact KL gradient help a model learn a
task, in domain and out of domain, against a proxy reward, and under asynchronous lag? Protocol: docs/task.md."""
