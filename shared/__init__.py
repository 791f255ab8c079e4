"""What two or more processes need: messages, ring, planner, GGUF index, config."""
