"""DepthFL, trimmed to what rankaudit reads (like Flower's depthfl baseline); for rankaudit's tests."""
