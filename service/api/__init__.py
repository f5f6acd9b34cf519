"""HTTP layer: the FastAPI app factory, request/response schemas, routes, auth. No business logic."""
