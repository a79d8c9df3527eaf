"""Generated protobuf and gRPC code for the robustrl public API (see protos/). Do not edit."""
