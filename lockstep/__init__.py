"""The `lockstep` command line: one entry point that dispatches to the simulator and the engine."""
