"""What model and optimizer loads share: plans' types, each tensor's checks, loads in place."""
