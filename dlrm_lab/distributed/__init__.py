"""Process groups (context, launch), sharding policy (plan), wrapping for training (wrap), tables (tables)."""
