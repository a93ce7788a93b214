"""The Ray layer of ray_zep: driver, data actor, training workers, metrics export."""
