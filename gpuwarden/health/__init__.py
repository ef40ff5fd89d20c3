"""Health gating: GPU and node checks, verdicts, and the drain/resume state machine."""
