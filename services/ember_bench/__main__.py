from ember_bench.cli import main

main()
