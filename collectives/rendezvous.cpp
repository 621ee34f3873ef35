// rendezvous: being written.
