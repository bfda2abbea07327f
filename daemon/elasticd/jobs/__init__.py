"""Jobs on this node: their records and state machine, and their scheduling onto slots."""
