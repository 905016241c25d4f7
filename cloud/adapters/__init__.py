"""The entry points: gRPC, WebRTC, the OpenAI-compatible HTTP and Realtime APIs, Ray Serve, health and logs."""
