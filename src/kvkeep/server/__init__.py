"""The kvkeep cache server, its wire protocol and its synchronous client."""
