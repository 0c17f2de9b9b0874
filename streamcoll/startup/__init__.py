"""Start-up: finding the ranks, hosts and environment a launcher left, the store
rendezvous, and making a communicator (init, new_communicator)."""
