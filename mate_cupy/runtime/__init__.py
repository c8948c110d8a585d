"""Runtime: DLPack interop and streams, device properties, workspaces."""
