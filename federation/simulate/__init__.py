"""The federation simulated beyond what this machine can run (`fedctl simulate`)."""
