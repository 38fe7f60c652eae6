"""Commands and helpers above the plugin: the console command, the demo, the SmolLM2
testbed, server and engine processes, and what `train eval` and the benchmarks share.
The plugin core never imports this package."""
