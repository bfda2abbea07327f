"""Worker processes: spawning and stopping them as the job's user, and the contract they run under."""
