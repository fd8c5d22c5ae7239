"""End-to-end tests: real `tether serve` processes, real sockets, real signals."""
