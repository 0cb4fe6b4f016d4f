"""What lowering did, for a person or a tool: the partition report, the graph picture."""
