"""Progress beats from the ranks, and the verdicts drawn from them: hangs, learned timeouts, stragglers."""
